"""The wire contract (records, codec, topic names) and the Faust app that assembles groups."""
