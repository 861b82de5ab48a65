"""`ttft-relay diagnose`: why a first token is slow, probed direct and through the relay."""
