"""`blockdraft serve`: an OpenAI-compatible server for AR, DFlash and DDTree (see server.py)."""
