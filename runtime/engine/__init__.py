"""The engine: its step loop, the clients that drive it (in this process or another) and its outputs."""
