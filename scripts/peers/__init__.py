"""Peers: the systems users run instead of dhp, driven as their users drive them (`dhp bench peers`)."""
