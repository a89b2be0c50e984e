{{/* Name of every object: the release name, or release-kvcd when it does not say kvcd. */}}
{{- define "kvcd.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "kvcd.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "kvcd.labels" -}}
{{ include "kvcd.selectorLabels" . }}
app.kubernetes.io/part-of: kvcd
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{/* The daemon's config file: the values' config plus what the chart owns. */}}
{{- define "kvcd.config" -}}
{{- $c := deepCopy .Values.config -}}
{{- $_ := set $c "listen" (printf "0.0.0.0:%d" (int .Values.ports.grpc)) -}}
{{- $_ := set $c "health_listen" (printf "0.0.0.0:%d" (int .Values.ports.health)) -}}
{{- $_ := set $c "metrics_listen" (printf "0.0.0.0:%d" (int .Values.ports.metrics)) -}}
{{- $_ := set $c "backend" .Values.backend -}}
{{- if eq .Values.backend "cuda" }}{{ $_ := set $c "cuda_device" 0 }}{{ end -}}
{{- /* config.tls and config.auth may hold the reload intervals; the chart adds the files. */ -}}
{{- if .Values.tls.enabled -}}
{{- $tls := merge (dict "cert_file" "/etc/kvcd/tls/tls.crt" "key_file" "/etc/kvcd/tls/tls.key") ($c.tls | default dict) -}}
{{- if .Values.tls.clientCA }}{{ $_ := set $tls "client_ca_file" "/etc/kvcd/tls/ca.crt" }}{{ end -}}
{{- $_ := set $c "tls" $tls -}}
{{- end -}}
{{- if .Values.auth.enabled -}}
{{- $_ := set $c "auth" (merge (dict "tokens_file" "/etc/kvcd/auth/tokens") ($c.auth | default dict)) -}}
{{- end -}}
{{- toYaml $c -}}
{{- end -}}

{{/* preStop sleep + the drain rounded up to seconds + 5 s of margin. */}}
{{- define "kvcd.terminationGracePeriodSeconds" -}}
{{- add (int .Values.preStopSleepSeconds) (div (add (int .Values.config.drain_timeout_ms) 999) 1000) 5 -}}
{{- end -}}

{{/* Non-empty when the Prometheus Operator's CRDs can be used: the cluster serves
monitoring.coreos.com/v1, or assumePrometheusOperator says to render them anyway. */}}
{{- define "kvcd.prometheusOperator" -}}
{{- if or .Values.assumePrometheusOperator (.Capabilities.APIVersions.Has "monitoring.coreos.com/v1") -}}
true
{{- end -}}
{{- end -}}

{{/* Labels of a component of the cluster (etcd, redis): (dict "root" . "name" "etcd"). */}}
{{- define "kvcd.componentSelectorLabels" -}}
app.kubernetes.io/name: {{ .name }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
{{- end -}}

{{- define "kvcd.componentLabels" -}}
{{ include "kvcd.componentSelectorLabels" . }}
app.kubernetes.io/part-of: kvcd
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version }}
{{- end -}}

{{/* Non-empty when the daemons form a cluster with peers (config.cluster.membership etcd or dns). */}}
{{- define "kvcd.clusterPeers" -}}
{{- $c := .Values.config.cluster | default dict -}}
{{- if has ($c.membership | default "none") (list "etcd" "dns") -}}
true
{{- end -}}
{{- end -}}

{{/* The port of a ZeroMQ endpoint tcp://host:port. */}}
{{- define "kvcd.endpointPort" -}}
{{- regexFind "[0-9]+$" . -}}
{{- end -}}
