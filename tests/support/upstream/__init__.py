"""Test code copied verbatim from other projects' releases (each module's header names the release, the URL and the
lines), for the peer suites that run it against hsoffload."""
