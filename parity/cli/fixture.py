"""`parity fixture` (stub: to be implemented)."""


def register(sub):
    p = sub.add_parser("fixture", help="(not implemented yet)")
    p.set_defaults(func=lambda args: print("parity fixture: not implemented yet") or 2)
