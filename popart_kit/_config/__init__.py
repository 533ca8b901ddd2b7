"""A session's description and what is derived from it: the fields (``fields``), the rules
over them, PopART's SessionOptions and device request (``mapping``, ``catalog``), poprun's
environment (``popdist``), the plan and its launch artefacts, config files, and
``SessionConfig`` on top, which joins them."""
