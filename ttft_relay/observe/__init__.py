"""What watches many records: exporters and what the relay learns across requests."""
