"""How bytes move between processes: the wire schema, the tensor codec, ZeroMQ endpoints and
their security. Imports neither `runtime` nor `roles`.

Modules:
* `codec`: Message codec: msgpack payload plus one zero-copy frame per tensor.
* `endpoint`: What an endpoint does to every message: frames out, admission in, every drop
  counted.
* `rpc`: Request/reply over one ROUTER (server: transport.zmtp_router's, or zmq.asyncio's with
  Curve) or zmq.asyncio DEALER (client) socket.
* `security`: Handshake authentication: CurveZMQ for cross-host runs, PLAIN with the run token
  locally.
* `sockets`: The sockets endpoints use, with the policy of `ChannelOptions` applied.
* `throttle`: A log throttle for warnings a peer can cause once per message it sends.
* `wire`: The wire schema: every message that crosses a process boundary.
* `zmtp`: ZMTP 3.0 wire pieces: greeting, frame headers, commands, metadata (RFC 23/ZMTP).
* `zmtp_connection`: One peer of transport.zmtp_router's ROUTER: the ZMTP greeting and
  handshake, then frames read into messages, each checked against the router's cap before its
  body is read.
* `zmtp_router`: A ZMTP 3.0 ROUTER in asyncio that bounds a whole message, not just each frame.
"""
