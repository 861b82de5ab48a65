"""Access: who may use the relay (keys, TLS listeners, no open proxy), and secrets kept out of every output."""
