"""The gateway's routes by family: operations, white-box, black-box; each a router given the parts it uses."""
