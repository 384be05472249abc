"""The target service: owns each session's committed tokens and KV cache, verifies draft blocks.

Entry points: ``target_service.main.run(settings)`` (``tandem target``) and
``target_service.main.start_target(engine)`` (in-process, for tests); the engine itself is
``target_service.engine.TargetEngine``.
"""
