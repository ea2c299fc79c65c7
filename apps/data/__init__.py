"""The dashboard's data access: what each view shows, queried from the store on demand.

``DashboardData`` (store.py) holds the connection, the run list and the per-run analysis results
(computed once by tracekit's library and shared by every session). One module per view holds its
queries: overview, heatmap, timeline, cpwait, memory, numerics. Nothing here draws.
"""

from apps.data.store import DashboardData

__all__ = ["DashboardData"]
