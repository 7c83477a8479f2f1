"""Volumes: named, persistent, project-owned directories that sandboxes mount (store.py)."""
