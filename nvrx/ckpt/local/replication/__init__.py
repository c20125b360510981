"""Replication of local checkpoints between ranks in different failure domains (spec 002)."""
