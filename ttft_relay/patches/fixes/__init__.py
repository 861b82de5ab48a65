"""Patches into mitmproxy that correctness or security needs: without one, mitmproxy would
crash, hang, lose what a client said, read what the relay refused, show a secret, or answer
in its own words. Each stands on pinned mitmproxy code (`PINS`, ../pins.py): where that code
changed the relay does not start, saying which fix and which mitmproxy to install — except
the fixes with a `WITHOUT`, which the relay can do without: it runs with them off and says
what it then does. With the addon that installs each (in `load`/`configure`, removed in `done`):

- `error_replies`: upstream failures reach the client in the API's error format, not as
  mitmproxy's HTML page or a bare close; error texts cut to a bound (`faults.ErrorReplies`).
- `eager_connects`: a reverse proxy's failed eager connect is answered, not a bare close
  (with `error_replies`); no upstream connection before a relay key is checked
  (`keys.AccessKeys`; the upstream pool defers them too).
- `answer_on_head`: a request refused on its head is answered without reading its body
  (`keys.AccessKeys`, `hygiene.FieldSyntax`, `faults.Shutdown`).
- `head_limit`: an HTTP/1 request head that never ends gets a 431 (`limits.ClientLimits`).
- `upstream_copy`: the upstream key goes out in a copy of the request, never into the flow
  (`keys.AccessKeys`, `upstream_pool.UpstreamPool`).
- `trailers`: HTTP/1 trailers, endless chunk lines and malformed chunked bodies end their
  flow with an answer instead of a crash or unbounded memory (`faults.ErrorReplies`).
- `interim_answers`: an upstream's 1xx interim head is dropped before its real answer,
  which it would otherwise replace (`stream.Streaming`).
- `client_resets`: an HTTP/2 client's stream reset always reaches its flow, and a client
  resetting streams in a loop gets GOAWAY (rapid reset) (`limits.ClientLimits`).
- `stream_resets`: a deadline resets its flow's HTTP/2 upstream stream, not the connection
  its siblings share (`faults.Deadlines`; WITHOUT: the connection is closed).
- `resend`: an answer held for a look before the client gets any of it, and the request
  sent once more in its place (`trim.Trim`: a refusal as too long, trimmed to the
  provider's word; WITHOUT: the refusal reaches the client).
- `web_options`: mitmweb's option dumps show the secrets of `proxyauth`, `upstream_auth`
  and `web_password` redacted, and its views of a flow in flight (the list, its live
  updates, the dump, the exports) the flow's credentials redacted (`redaction.WebOptions`).
- `websocket_limits`: a WebSocket message's inflated size, its fragments and the control
  frames around it bounded as wsproto reads them (`limits.WebSocketLimits`).
- `websocket_text`: a WebSocket text message an addon changed goes on with every character
  whole, not U+FFFD where mitmproxy's re-framing split one (`trim.Trim`, whose trimmed turns
  are such messages; WITHOUT: they may carry U+FFFD).
- `inherited_listeners`: a worker of `ttft-relay run --workers N` serves the listening
  sockets its supervisor bound (installed by `workers.worker_main` before mitmproxy starts,
  removed by `capacity.WorkerListeners`; the supervisor checks its pins before it starts
  any worker).
- `happy_eyeballs`: mitmproxy's upstream connect races the name's addresses (RFC 8305)
  instead of trying them in turn, so a black-holed IPv6 address costs 250 ms, not the
  request (`dial.HappyEyeballs`).
- `ca_at_start`: mitmproxy's CA loaded while the relay loads, before a request can need it
  (no patch; `capacity.WarmStart`; WITHOUT: mitmproxy loads it after its listeners are up).
"""
