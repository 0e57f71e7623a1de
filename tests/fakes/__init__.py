"""Local stand-ins for cloud endpoints: real HTTP servers on loopback that check what the official
SDKs send, answer as the cloud would, and record every request for assertions."""
