"""`parity diff` (stub: to be implemented)."""


def register(sub):
    p = sub.add_parser("diff", help="(not implemented yet)")
    p.set_defaults(func=lambda args: print("parity diff: not implemented yet") or 2)
