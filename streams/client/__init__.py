"""The client SDK: what agents, trainers and tools call to write records, acknowledged by the broker, and to
read them back (the records themselves are ``streams.wire``)."""
