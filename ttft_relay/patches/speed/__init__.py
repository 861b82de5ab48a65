"""Patches into mitmproxy that only make the relay faster: with every one off the client gets
the same bytes and the timing log the same records, for more CPU per request (a test runs the
relay both ways). They run only on the mitmproxy their pins were taken from (`PINS`,
../pins.py) and while `relay_speed_patches` is on; anywhere else they stay off and one line
says so. With the addon that installs each (in `configure`/`running`, removed in `done`):

- `splice`: a streamed HTTP/1 response body goes from the upstream's reader to the client's
  framing in one step, not through mitmproxy's per-chunk routing; with direct reads, a
  chunked one (plain TCP or TLS) is read from socket to socket below mitmproxy's layers
  (`stream.Streaming`).
- `hook_plans`: events dispatched from per-hook plans, not a walk of every addon per event
  (`capacity.HookPlans`).
- `message_checks`: a request's and a response's field types checked as mitmproxy checks
  them, from classes kept per field (`capacity.MessageChecks`).
- `listen_backlog`: listeners queue more than 100 new connections, so the clients of a
  burst do not wait 1-3 s for a SYN retransmit (`capacity.ListenBacklog`).
- `ca_once`: the CA is not loaded a second time in `running` (`capacity.WarmStart`).
- `upstream_tls_warmup`: the upstream TLS context built at start, not in the first
  handshake (no patch; `capacity.WarmStart`).
- `early_connects`: a request's upstream connect starts once its head is accepted, while
  its body uploads (`keys.AccessKeys`, `upstream_pool.UpstreamPool`).
- `upstream_pool`: a reverse listener's upstream connections outlive their client
  connection and are adopted by later ones, TLS included (`upstream_pool.UpstreamPool`, on by
  default; `relay_upstream_pool=false` turns it off alone).
- `websocket_frames`: a big WebSocket message (1 MiB and more, one frame, no extension) framed
  for its way on in a worker thread and sent as framed, not by wsproto on the event loop
  (`frames.WebSocketFrames`).
- `hedge`: a request whose answer's head is late goes to a second upstream as well, the first
  head wins and the other attempt is closed before any byte of it reaches the client
  (`route.UpstreamGroups`, `relay_upstream_hedge`; off, the late head is waited for).
"""
