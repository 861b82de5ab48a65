"""Guard: who may use the relay, and where its secrets may go.

A relay sits between its users and a paid API key. One module per concern, each with its
addons (relay.py lists every one of them, in order):

    exposure    no start as an open proxy: authentication and TLS off loopback
    tls         listeners that accept only TLS (the user's certificate), plain HTTP refused
    limits      what a client may cost before authentication (head deadline, connections,
                HTTP/2 resets) and on a WebSocket (message size, fragments, control frames)
    hygiene     what no peer is sent: CR, LF or NUL in header values, an unknown HTTP
                version, an absolute-form target upstream, an HTTP/2 body without its length
    keys        relay access keys checked on the head, the upstream key swapped in
    redaction   credentials redacted in every log line, flow and mitmweb view
    refusals    the relay's own answer to a request it refuses, in the client's API's format
"""
