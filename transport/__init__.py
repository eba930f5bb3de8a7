"""How bytes move between processes: the wire schema, the tensor codec, ZeroMQ endpoints and
their security. Imports neither `runtime` nor `roles`.

Modules:
* `codec`: Message codec: msgpack payload plus one zero-copy frame per tensor.
* `endpoint`: What an endpoint does to every message: frames out, admission in, every drop
  counted.
* `rpc`: Request/reply over one zmq.asyncio ROUTER (server) or DEALER (client) socket.
* `security`: Handshake authentication: CurveZMQ for cross-host runs, PLAIN with the run token
  locally.
* `sockets`: The sockets endpoints use, with the policy of `ChannelOptions` applied.
* `throttle`: A log throttle for warnings a peer can cause once per message it sends.
* `wire`: The wire schema: every message that crosses a process boundary.
"""
