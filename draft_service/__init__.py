"""The draft service: runs the speculation loop of each session against the target's Verify stream.

Entry points: ``draft_service.main.run`` (the ``tandem draft`` process) and
``draft_service.main.start_draft`` (in-process, for tests and ``tandem serve``).
"""
