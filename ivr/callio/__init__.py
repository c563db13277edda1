"""The seam between what a call does (``ivr.flows``) and how it sounds (``ivr.call``).

Below both: ``CallIO`` and the capabilities an implementation declares (``io``), the policies
a flow sets per node for how its prompts give way and how its turns end
(``interruption_policy``, ``turn_policy``), speculation (``speculation``, and the ``prefetch``
and ``sentences`` both sides share), and the call's ``timeline``. Neither side imports the
other: ``ivr.flows`` never imports ``ivr.call`` (an import-linter contract).
"""
