"""Pipeline parallelism: the layout (``layout``), FQN-stable stage splitting (``split``) and the
schedule run inside Lightning's loop (``runner``)."""
