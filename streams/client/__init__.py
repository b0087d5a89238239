"""The client SDK: what agents and trainers call to write records, acknowledged by the broker."""
