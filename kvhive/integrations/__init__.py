"""kvhive on engines that fleets already operate (``ray``: a Ray Serve application)."""
