"""Op definitions (schemas, device implementations, autograd). Importing registers them."""

from . import logprobs  # noqa: F401
