"""The launcher's plan and its closed loop: what it knows of the model before any rank starts
(``model_size``), the plan for the spec and the probes (``plan``), the memory measured across attempts
(``memory_loop``) and the re-plan it leads to (``replan``)."""
