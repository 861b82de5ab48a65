"""What watches the records and the relay itself: the self-watch (event-loop lag, accept queues,
TCP_INFO), the metrics and their endpoint, the in-flight ledger, the mitmweb column, the learned
prefill rates and cached conversations behind the verdicts, attempt groups, and trace export (OTLP)."""
