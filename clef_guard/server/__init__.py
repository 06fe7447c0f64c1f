"""The System One HTTP API over a local engine (``pip install 'clef-guard[serve]'``)."""
