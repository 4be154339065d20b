"""Conversions to and from other frameworks' sharding objects (optional extras)."""
