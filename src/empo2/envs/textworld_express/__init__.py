"""TextWorldExpress (pip ``textworld-express``): text games generated on the fly, CoinCollector first. The package is
the environment (:mod:`.env`), its games' parameters (:mod:`.games`), its state (:mod:`.state`) and its gold paths
(:mod:`.gold`); importing it starts no JVM."""
