"""`ttft-relay report`: the relay's timing logs summarised, as text, JSON or one HTML page."""
