"""Op definitions (schemas, device implementations, autograd). Importing registers them."""

from . import logprobs  # noqa: F401
from . import sampler  # noqa: F401
from . import mask_reduce  # noqa: F401
from . import sinkgd  # noqa: F401
from . import linear_logprobs  # noqa: F401
from . import distill  # noqa: F401
