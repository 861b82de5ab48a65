"""Streaming: every response stream passed chunk by chunk, the SSE watcher, WebSocket turns, the event-stream view."""
