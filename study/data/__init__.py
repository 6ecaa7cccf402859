"""Text in, rewards out, no models: the verifiable tasks and user data (tasks.py), the tokenizer (tokenizer.py)."""
