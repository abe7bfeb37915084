"""Where a step's target forward runs: in this process (``UniprocExecutor``), or split over
tensor-parallel ranks, rank 0 here and the others in processes of their own
(``MultiprocExecutor``)."""
