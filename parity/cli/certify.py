"""`parity certify` (stub: to be implemented)."""


def register(sub):
    p = sub.add_parser("certify", help="(not implemented yet)")
    p.set_defaults(func=lambda args: print("parity certify: not implemented yet") or 2)
