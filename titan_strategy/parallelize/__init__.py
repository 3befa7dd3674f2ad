"""Parallelization: one module per technique, each with one entry function, and ``apply.parallelize`` applying them
in the order that keeps them composable. ``plain`` derives a plan for a module that declares none; ``materialize``
allocates and initializes what was built on the meta device."""
