// Building prometheus-cpp metric families by hand, for collectables that report values read
// at scrape time (the daemon's Stats-derived families, the cluster's): one family, then one
// sample per call, a counter's or a gauge's value by the family's type.
#pragma once

#include <prometheus/metric_family.h>

#include <utility>
#include <vector>

namespace kvcd::metrics {

inline prometheus::MetricFamily Family(const char* name, const char* help,
                                       prometheus::MetricType type) {
  prometheus::MetricFamily f;
  f.name = name;
  f.help = help;
  f.type = type;
  return f;
}

inline void Add(prometheus::MetricFamily* f, double value,
                std::vector<prometheus::ClientMetric::Label> labels = {}) {
  prometheus::ClientMetric m;
  m.label = std::move(labels);
  if (f->type == prometheus::MetricType::Counter) {
    m.counter.value = value;
  } else {
    m.gauge.value = value;
  }
  f->metric.push_back(std::move(m));
}

}  // namespace kvcd::metrics
