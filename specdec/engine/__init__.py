"""Drafter and verifier engines: sessions + model runtime + drafting / verification."""
