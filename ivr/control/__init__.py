"""Call control: Twilio's side of a call, as opposed to its audio (``ivr.call``).

What answers Twilio's requests and decides what a call does next: the TwiML that opens a
stream (``connect``) and its signed one-use tokens (``tokens``), signature checks
(``webhook_auth``), transfers (``transfers``; warm ones with their callbacks: ``warm``,
``warm_routes``, ``warm_summary``), Twilio's status callbacks (``status_callbacks``), how every
call ends once (``endings``, ``summary``; ``sweeper`` for calls nobody ended), and whether a
person or a machine answered a call we placed (``answer``).
"""
