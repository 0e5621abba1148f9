"""Airflow shell around the phase library: operators, a deferrable trigger, the DAG factory, the plugin.

Nothing here holds training logic; importing this package imports neither torch nor ray.
"""
