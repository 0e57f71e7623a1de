"""Local stand-ins the tests run against: cloud endpoints (real HTTP servers on loopback that check
what the official SDKs send, answer as the cloud would, and record every request for assertions),
a scripted generation engine for real rollout workers (`engine`), and a Redis client whose traffic
a test can pause (`redis_gate`)."""
