"""fl-coordinator: federated training rounds over clients that keep their data (after Chai et al.,
OpML '19, and TiFL, HPDC '20): aggregation strategies in Flower's manner, tiered client selection,
deadlines, stragglers, semi-asynchronous rounds, and a simulator that runs the same code."""
