"""The ``areal`` command line (AReaL 2.0's verbs): ``areal train``, ``areal inf``,
``areal agent run``. ``main.py`` parses the verb; one module per verb group runs it."""
