"""The names of the cluster's policies (paper §9), in comparison order, without importing the policies themselves
(the CLI lists them before anything heavy loads). ``policies.POLICIES`` is keyed by exactly these."""

POLICY_NAMES = ("pc", "local-pic", "nebula")
