"""Registry records, one module per op family; importing this package registers them all."""
from . import elementwise, norm, conv, kda, mla, moe, embed, slots  # noqa: F401
