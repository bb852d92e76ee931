"""The OpenAI-compatible front end: validate, tokenize once, place, stream, fail over."""
