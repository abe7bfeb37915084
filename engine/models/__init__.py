"""Model definitions; each architecture is declared once in ``engine.registry``."""
