"""An out-of-tree router that declares its own regime (for the compare command's test)."""

from examples.nearest_replica import NearestReplica


class DecodeRegime(NearestReplica):
    name = "nearest-decode-regime"
    own_regime = {"workload.gen_tokens": 3, "workload.rate_per_s": 2.0}
