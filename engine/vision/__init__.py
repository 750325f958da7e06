"""Images: the inputs a request carries (inputs.py) and the vision encoder that turns them into
embeddings for the language model (docs/images.md)."""
