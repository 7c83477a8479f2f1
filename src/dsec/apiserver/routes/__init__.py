"""dsec's own API, one router per resource (all share apiserver/deps.py)."""
