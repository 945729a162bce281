"""`parity golden` (stub: to be implemented)."""


def register(sub):
    p = sub.add_parser("golden", help="(not implemented yet)")
    p.set_defaults(func=lambda args: print("parity golden: not implemented yet") or 2)
