"""ttft_relay/patches/users.py: a shared patch stays in while anyone asked for it."""

from ttft_relay.patches.users import Users


def test_the_patch_comes_out_when_the_last_user_lets_go():
    users = Users()
    users.add("keys")
    users.add("pool")
    assert not users.release("keys")
    assert not users.release("stranger")  # one that never asked changes nothing
    assert users.release("pool")


def test_none_releases_everyone():
    users = Users()
    users.add("keys")
    users.add("pool")
    assert users.release(None)
    assert users.release("keys")  # still out
